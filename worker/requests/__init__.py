"""Engine requests from contract requests: chat templates, sampling parameters, tooling, model checks."""
