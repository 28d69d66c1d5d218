"""The pure model of a run: event kinds, ids, refs, the fold and its snapshot codec.

No SQL and no torch at import time; everything here is a function of the log.
"""
