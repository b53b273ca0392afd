"""eprt: an expert-parallel runtime for serving Mixture-of-Experts language models with MPI."""

__version__ = "0.1.0"
