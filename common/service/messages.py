"""Conversions between protobuf messages and our dataclasses (sampling params, meta_info).
Torch-free: the router imports it."""
from __future__ import annotations

from common.engine.sampling import SamplingParams
from protos import pdflash_pb2 as pb


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                            max_new_tokens=p.max_new_tokens, stop_token_ids=list(p.stop_token_ids),
                            stop=list(p.stop), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
        max_new_tokens=msg.max_new_tokens, stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop), seed=msg.seed if msg.HasField("seed") else None, ignore_eos=msg.ignore_eos)


def meta_to_proto(meta: dict) -> pb.MetaInfo:
    stop = meta.get("matched_stop")
    return pb.MetaInfo(
        prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"],
        cached_tokens=meta["cached_tokens"], finish_reason=meta["finish_reason"] or "",
        e2e_latency=meta["e2e_latency"], matched_stop="" if stop is None else str(stop),
        spec_verify_ct=meta.get("spec_verify_ct", 0),
        spec_accept_histogram=meta.get("spec_accept_histogram", []),
        spec_accepted_drafts=meta.get("spec_accepted_drafts", 0),
        spec_proposed_drafts=meta.get("spec_proposed_drafts", 0),
        spec_block_histogram=meta.get("spec_block_histogram", []),
        spec_plain_steps=meta.get("spec_plain_steps", 0),
        verified_pages=meta.get("verified_pages", 0),
        transfer_bytes=meta.get("transfer_bytes", 0),
        transfer_transport=meta.get("transfer_transport", ""))
