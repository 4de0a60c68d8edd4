"""The GRPO recipe: the policy update of GRPO/PPO from rollouts (``train-recipes grpo``)."""
