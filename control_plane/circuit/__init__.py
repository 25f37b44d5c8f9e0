"""`met circuit diff`: proofs that a forward computes what the reference computes."""
