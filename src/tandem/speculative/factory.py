"""Build the runner's side of speculation from a `SpecConfig`: the decoder (proposer + verifier,
with its pruning and overlap options). The scheduler's side is tandem.sched.build.make_speculation;
tandem.llm wires both."""

from __future__ import annotations

from tandem.config import SpecConfig
from tandem.errors import ConfigError
from tandem.runner.passes import ForwardPass
from tandem.speculative.decoder import SpecDecoder
from tandem.speculative.drafter import ModelDrafter
from tandem.speculative.ngram import NgramProposer
from tandem.speculative.overlap import DraftWorker
from tandem.speculative.pruning import EarlyExit
from tandem.speculative.suffix import SuffixProposer


def make_spec_decoder(cfg: SpecConfig, runner, target_vocab: int, tokenizer=None, load_draft=None,
                      reuse: SpecDecoder | None = None) -> SpecDecoder:
    """`runner` is the target's TorchExecutor; `load_draft(path) -> (LlamaModel, Tokenizer)` loads a
    draft model. `reuse`: a decoder of the same method whose proposer (and draft worker) to keep,
    as a benchmark switching options on a loaded engine does; the rest comes from `cfg`."""
    if cfg.run_ahead != "off":
        raise ConfigError("run_ahead is modelled by the simulator (tandem simulate); the engine's runner "
                          "does not draft ahead of verification yet")
    if reuse is not None and reuse.method == cfg.method:
        proposer = reuse.proposer
    else:
        proposer = _make_proposer(cfg, runner, target_vocab, tokenizer, load_draft)
    early_exit = (EarlyExit(runner.model, cfg.early_exit_layer, cfg.early_exit_topk)
                  if cfg.early_exit_layer is not None else None)
    overlap = None
    if cfg.overlap:                         # (SpecConfig has checked the method drafts with a model)
        old = reuse.overlap if reuse is not None else None
        overlap = old if old is not None and old.draft_threads == cfg.draft_threads else \
            DraftWorker(runner.device, cfg.draft_threads)
    return SpecDecoder(proposer, runner.sampler, method=cfg.method, frontier_size=cfg.frontier_size,
                       early_exit=early_exit, overlap=overlap)


def _make_proposer(cfg: SpecConfig, runner, target_vocab: int, tokenizer, load_draft
                   ) -> NgramProposer | SuffixProposer | ModelDrafter:
    if cfg.method == "ngram":
        return NgramProposer(cfg.ngram_min, cfg.ngram_max, cfg.max_draft_tokens)
    if cfg.method == "suffix":
        return SuffixProposer(cfg.max_draft_tokens, cfg.suffix_decoding_max_tree_depth,
                              cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_spec_factor,
                              cfg.suffix_decoding_min_token_prob, cfg.suffix_decoding_max_cached_tokens)
    model = runner.model
    if cfg.method == "layerskip":
        n = cfg.num_draft_layers or max(1, model.cfg.num_layers // 4)
        if n >= model.cfg.num_layers:
            raise ConfigError(f"num_draft_layers {n} must be below the target's {model.cfg.num_layers} layers")
        return ModelDrafter(ForwardPass(model, runner.attn, runner.block_size, runner.device, num_layers=n),
                            _draft_sampler(runner), shares_target_kv=True)
    if load_draft is None:
        raise ConfigError("a draft model is loaded with the engine (tandem.llm.build_engine), not swapped in later")
    draft_model, draft_tok = load_draft(cfg.draft_model)
    _check_same_vocabulary(draft_model.cfg.vocab_size, target_vocab, draft_tok, tokenizer)
    from tandem.runner.attention import AttentionBackend, PagedKVCache

    dc = draft_model.cfg
    cache = PagedKVCache(dc.num_layers, runner.cache.num_blocks, runner.block_size, dc.num_kv_heads, dc.head_dim,
                         runner.cache.dtype if draft_model.dtype == runner.model.dtype else draft_model.dtype,
                         runner.device)
    draft_model.ops = model.ops
    attn = AttentionBackend(cache, dc.num_heads, dc.num_kv_heads, dc.head_dim, model.ops)
    return ModelDrafter(ForwardPass(draft_model, attn, runner.block_size, runner.device), _draft_sampler(runner))


def _draft_sampler(runner):
    """Drafts draw from their own random stream (never the one verification draws from)."""
    from tandem.runner.sampler import Sampler

    return Sampler(runner.device, runner.sampler.seed, stream=1)


def _check_same_vocabulary(draft_vocab: int, target_vocab: int, draft_tok, target_tok) -> None:
    if draft_vocab != target_vocab:
        raise ConfigError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's ({target_vocab})")
    if draft_tok is not None and target_tok is not None:
        probe = "Speculative decoding: 1234 + 5678 = ?\n"
        if draft_tok.encode(probe) != target_tok.encode(probe) or \
                draft_tok.hf.get_vocab() != target_tok.hf.get_vocab():
            raise ConfigError("the draft model's tokenizer differs from the target's")
