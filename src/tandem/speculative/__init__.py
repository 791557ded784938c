"""Speculative decoding MECHANISM: proposers (n-gram, draft model, layer-skip) and verification.

The POLICY (how many tokens each request drafts each step) lives in tandem.sched.spec_length.
"""
