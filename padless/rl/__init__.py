"""The sampler side of RL: generation engines (HF, vLLM), sampling ahead, multi-turn episodes, environments
and tools, rewards, and the rollout-trainer correction."""
