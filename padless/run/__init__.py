"""The run machinery every trainer shares: the loop, checkpoints and the resume contract, run folders,
sessions, strategies, the divergence guard, logs and interrupts."""
