"""The DPO recipe: offline preference tuning (sigmoid DPO, SimPO) of a causal LM."""
