"""The model's tokenizer from a CMF's vocab section (tokenizer.json): as `tokenizers` parses it, for the
stages that tokenize, and as transformers knows it, with the `tokenizer_config` of its header (special tokens
and the chat template), for chat rendering, where the template may use `bos_token` and friends, and for export."""

from __future__ import annotations

from nvg.errors import NvgError


def cmf_tokenizer(cmf, source, purpose: str):
    """The CMF's tokenizer (`tokenizers.Tokenizer`); one error line naming `source` when it has none to `purpose`."""
    from tokenizers import Tokenizer

    if not cmf.vocab:
        raise NvgError(f"{source}: vocab section is empty: no tokenizer to {purpose}")
    return Tokenizer.from_str(cmf.vocab.decode("utf-8"))


def hf_tokenizer(cmf, source, purpose: str):
    """The CMF's tokenizer as transformers knows it (`PreTrainedTokenizerFast`), with its special tokens and chat
    template; the same error line as `cmf_tokenizer` when it has none."""
    from transformers import PreTrainedTokenizerFast

    tok_cfg = cmf.header.get("tokenizer_config", {})
    tok = cmf_tokenizer(cmf, source, purpose)
    special = {}
    if tok_cfg.get("eos_token_ids"):
        special["eos_token"] = tok.id_to_token(tok_cfg["eos_token_ids"][0])
    for key, name in (("bos_token_id", "bos_token"), ("pad_token_id", "pad_token")):
        if tok_cfg.get(key) is not None:
            special[name] = tok.id_to_token(tok_cfg[key])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   chat_template=tok_cfg.get("chat_template"), **special)
