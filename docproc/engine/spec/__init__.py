"""Speculative decoding: a draft model proposes, the target verifies K + 1 positions in one pass.

proposer.py  the draft's side: its view of each sequence, its cache, K proposal rounds
verifier.py  the target's side: windows beside each sequence, one forward, acceptance
rejection.py the acceptance rule, batched on the device (the output distribution is the target's)
policy.py    the adaptive K: measured costs and acceptance -> the K that maximises tokens per second
draft.py     DraftView (the draft's bookkeeping) and the tokenizer check
setup.py     building the draft next to a target: KV budget split, vision sharing
"""
