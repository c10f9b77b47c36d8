"""The model-agnostic adapter layer: one declarative description per model family, shared machinery.

How a target is boosted
=======================

``lite_boost.boost(pipe)`` looks the pipeline's class up in :mod:`lite_boost.registry` (walking its
MRO) and calls the boost function its family registered. That function runs :func:`boost_model` on
every transformer of the pipeline with the family's :class:`ModelFamily`: the family's processor
shim goes on every module matching an attention site, its RoPE module gets the cached fp32 tables,
and ``config.sparse`` / ``config.cache`` install block-sparse attention (:mod:`.sparse`) and
diffusers' step-cache hooks (:mod:`.cache`). ``ParallelManager(pipe)`` (:mod:`lite_boost.api`) does
the same boost, then hands the family's sharding and pipeline plans to :mod:`lite_boost.parallel`,
which executes them with generic hooks and wraps each processor's ``attn_fn`` in Ulysses.

Layering (checked by the import contracts in ``pyproject.toml``): ``lite_boost.models`` (one module
per family: data plus shims) imports this package; this package imports ``parallel``, ``ops``,
``cache``, ``config``; ``parallel`` and ``ops`` import nothing of either; the registry imports
nothing of lite_boost.

How to add a family (worked example: ``lite_boost/models/qwenimage.py``)
=========================================================================

A family is about 100-200 lines in ``lite_boost/models/<family>.py`` plus its tests.

1. **Read the diffusers model** (the design notes' per-family study, ``design/models.md``, has it):
   the processor's ``__call__`` signature and body, which streams it attends and in what order, the
   text mask, what the RoPE module returns, the pipeline's CFG calls, diffusers' ``_cp_plan``.

2. **Processor shim** (one class per processor family). Subclass :class:`LiteBoostProcessor`; in
   ``__call__`` reuse the attention module's own projections and norms exactly as the stock processor
   does, rotate q and k with :func:`rotate_qk`, and hand the attention to ``self.attn_fn`` in the
   protocol of :mod:`lite_boost.ops.joint`::

       out = self.attn_fn(q, k, v)                                           # self-attention
       img_out, txt_out = self.attn_fn(img_q, img_k, img_v,
                                       joint=JointTokens(txt_q, txt_k, txt_v, key_mask, self.text_first))

   ``attn_fn`` is where dense dispatch, block-sparse attention and Ulysses plug in: never call SDPA
   for the sequence attention itself. A text padding mask goes in as ``key_mask`` (B, T) bool (True =
   attend); a dense (B, 1, S, S) mask must be turned into a key-padding mask. Cross-attention to a
   context every rank holds whole (role "cross") may call :func:`lite_boost.ops.attention` directly.
   ``QwenImageJointProcessor`` is 40 lines.

3. **RoPE shim** (when the model has a RoPE module): ``forward(rope_module, state) -> callable`` that
   returns what the processor expects, in :class:`~lite_boost.ops.rope.RotaryEmbedding` form:
   :func:`~lite_boost.ops.rope.phasors_from_complex` (complex tables, Qwen-Image),
   :func:`~lite_boost.ops.rope.phasors_from_cos_sin` (interleaved real cos / sin, HunyuanVideo, Flux),
   :func:`~lite_boost.ops.rope.rope_tables` (Wan's (t, h, w) grid). Keep them in
   ``state.rope_cache.get_or_build(key, build)`` and serve rows ``state.serve_range(n_tokens)`` (this
   rank's slice under sequence parallelism, identity rows past the end). ``matches(rope_module)``
   keeps diffusers' own module for variants the shim does not reproduce (Qwen-Image-Layered). RoPE
   passed in by the pipeline (CogVideoX) needs no shim: split the argument in the plan. A RoPE module
   whose arguments lack something the shim needs (Flux's sees the concatenated text + image ids,
   not where the text ends) reads ``state.call``: what the family's ``call_context(model, args,
   kwargs)`` took from the arguments of the transformer call in progress.

4. **Token grid** for sparse windows: ``token_grid(model, args, kwargs) -> (t, h, w)`` of the image /
   video tokens of a call, from shapes only (it runs in traced code); None runs that call dense.
   ``timestep_module`` names the child whose first argument is the timestep.

5. **Sharding plan** (:class:`~lite_boost.parallel.plan.ShardingPlan`): a ``SplitInput`` for every
   token-wise argument where it meets the blocks (hidden states at ``blocks.0``; per-token timesteps
   or modulation at ``blocks.*`` when the model passes them unsharded to every block; ids; RoPE tuples
   passed in), ``ndim`` filters for optional per-token forms; ``SplitOutput(module, dim, index)`` for
   RoPE module outputs when diffusers' own module is kept; ``GatherOutput("proj_out", 1)``;
   ``RankArg`` for rank-dependent scalars (HunyuanVideo-I2V's ``first_frame_num_tokens``);
   ``rope_range="rope_range"``; ``text="replicate"`` unless the processors attend the text as part of
   the sharded stream.

6. **Pipeline plan** (:class:`~lite_boost.parallel.plan.PipelinePlan`, :class:`~lite_boost.parallel.plan.CfgPlan`):
   the transformer attributes; the CFG kind: "separate" (two calls named by ``cache_context``; a
   ``flag`` attribute, or ``encodes`` / ``call_start`` when the pipeline keeps the decision local;
   ``output_shape`` when the pipeline slices the output before the second call), "batched" (one call
   with both branches on the batch: ``batch_args``), or "none"; the latent-preparation method.

7. **Step caching** (:class:`~lite_boost.cache.CacheAdapter`): the diffusers cache methods that work,
   each tested against the same hook on stock diffusers; ``why_not`` for the others (it goes into the
   error message); per-method ``defaults``; ``probe_module`` (a child run once per call before the
   blocks, e.g. the patch embedding).

8. **The rest of the description**: ``quant_patterns`` (module-name patterns quantized by default),
   ``unsupported`` (feature -> reason, shown by ``lite-boost models`` and in errors), ``notes``.
   ``ModelFamily.features`` derives the rest from the data; a request for a missing feature raises
   ``ConfigError`` naming the option before anything is touched or any collective runs.

9. **Register**: ``FAMILY = register_family(ModelFamily(...))`` in the module and one import line in
   ``lite_boost/models/__init__.py``. The family's ``boost_transformer`` / ``boost_pipeline`` are
   generated (``FAMILY.boost_pipeline.unboost`` undoes it).

10. **Tests**, on tiny in-memory pipelines (text encoders None, prompt embeddings passed in), following
    ``tests/test_qwen_image.py`` (boosted = stock within 1e-5 fp32 at awkward shapes: 3 heads, odd
    token grids, different cond / uncond text lengths, padded text; reversible and idempotent; sparsity
    0 = dense; every cache method = the stock diffusers hook; ``torch._dynamo.explain`` without a graph
    break; ``compile_repeated_blocks(fullgraph=True)`` = eager), ``tests/test_parallel_qwen_image.py``
    with ``tests/_dist_qwen_cases.py`` (2 and 3 ranks = one process, the blocks seeing a shard, CFG
    parallel, all cases of one world size in one spawned group) and
    ``tests/test_qwen_image_diffusers_model.py`` (diffusers' own model tests on the boosted model).
    Add the family's row to the README's support matrix.

Pitfalls: every per-token tensor must travel with its tokens (modulation indices, per-token timesteps,
masks over image tokens); replicated text must never enter the all_to_all (that is what ``joint=`` is
for); keep forwards compile-clean (no ``.item()``, locks or Python state in a block; decisions that
depend on data live in the opaque ops of :mod:`.sparse`); patch instances, never classes.
"""

from .boost import BoostState, boost_model, boost_pipeline, unboost_model, unboost_pipeline
from .family import FEATURES, JOINT_LAYOUTS, AttentionSite, ModelFamily, RopeSource
from .processor import ROLES, DenseAttention, LiteBoostProcessor, rotate_qk

__all__ = ["AttentionSite", "BoostState", "DenseAttention", "FEATURES", "JOINT_LAYOUTS", "LiteBoostProcessor",
           "ModelFamily", "ROLES", "RopeSource", "boost_model", "boost_pipeline", "rotate_qk", "unboost_model",
           "unboost_pipeline"]
