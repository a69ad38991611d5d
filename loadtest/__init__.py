"""kvrouter-loadtest: workloads, an emulated DP-attention engine, a simulator and reports."""
