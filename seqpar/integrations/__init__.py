"""Bridges between seqpar and other libraries' models.

:mod:`seqpar.integrations.hf`: HuggingFace ``transformers`` GPT-2 in (:func:`~seqpar.integrations.hf.from_gpt2`)
and out (:func:`~seqpar.integrations.hf.to_gpt2_state_dict`). Importing these modules never imports
the other library.
"""
