"""Bridges between seqpar and other libraries' models.

:mod:`seqpar.integrations.hf`: HuggingFace ``transformers`` GPT-2 in (:func:`~seqpar.integrations.hf.from_gpt2`)
and out (:func:`~seqpar.integrations.hf.to_gpt2_state_dict`), Llama likewise.
:mod:`seqpar.integrations.megatron`: Megatron-LM / Megatron-Core state dicts (their QKV row order and
Megatron-Core's names). Importing these modules never imports the other library.
"""
