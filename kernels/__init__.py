"""Triton kernels and their torch references (imports only torch and triton)."""
