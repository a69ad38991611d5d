"""Engine adapters: SGLang, vLLM internal-LB, vLLM external-LB."""
