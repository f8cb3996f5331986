"""Layout model, scalar reference, packing, KeyIndex and LookupEngine.

Never imports triton at module import time."""
