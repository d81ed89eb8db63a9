"""Speculative decoding: proposers (n-gram lookup, draft model), verification of 1 + k query
tokens per request in one target step, and exact rejection sampling.

``config`` (SpeculativeConfig), ``proposer`` (the Proposer protocol and registry), ``ngram``,
``rejection`` (accept / resample), ``decoder`` (the engine side: drafts per step, stats).
"""
