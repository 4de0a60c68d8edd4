"""The retrieval recipe: bi-encoder InfoNCE fine-tuning under DDP."""
