"""Speculative decoding's proposers and per-request depth rule (plain Python, no torch, no `Request`).

A proposer guesses the next tokens of a request from token ids alone (`proposers.py`: `ngram`, prompt
lookup in the request's own history; `suffix`, an n-gram index over its history and recent finished
requests); `depth.py` decides how many to guess from the acceptance it has measured. Verification, the
KV bookkeeping and the sampler's per-row draws are the engine's (`kvlm.engine.speculator`).
"""

from kvlm.spec_decode.depth import DraftDepth, plan_depths
from kvlm.spec_decode.proposers import METHODS, NgramProposer, Proposer, SuffixProposer, make_proposer

__all__ = ["METHODS", "DraftDepth", "NgramProposer", "Proposer", "SuffixProposer", "make_proposer", "plan_depths"]
