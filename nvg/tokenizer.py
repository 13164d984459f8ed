"""The model's tokenizer as transformers knows it, built from a CMF's vocab section (tokenizer.json)
and the `tokenizer_config` of its header (special tokens and the chat template): for chat rendering,
where the template may use `bos_token` and friends, and for export."""

from __future__ import annotations


def hf_tokenizer(cmf):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok_cfg = cmf.header.get("tokenizer_config", {})
    tok = Tokenizer.from_str(cmf.vocab.decode("utf-8"))
    special = {}
    if tok_cfg.get("eos_token_ids"):
        special["eos_token"] = tok.id_to_token(tok_cfg["eos_token_ids"][0])
    for key, name in (("bos_token_id", "bos_token"), ("pad_token_id", "pad_token")):
        if tok_cfg.get(key) is not None:
            special[name] = tok.id_to_token(tok_cfg[key])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   chat_template=tok_cfg.get("chat_template"), **special)
