"""``entrain-data demo``: the whole system end to end on bundled, generated data, on CPU.

1. writes a small multimodal WebDataset (real JPEG/PNG images from thumbnails to
   document pages, WAV clips of 1-30 s, texts of varied length) with the
   project's own generator, cached under ``--out``;
2. builds the Parquet index from the shard headers;
3. macro-profiles it and derives the static plan for 2 data-parallel ranks;
4. for ``sequential`` (Megatron-LM's fixed-count microbatches) and then
   ``entrain``, starts the loader service, trains the tiny reference MLLM
   (vision + audio encoders, decoder LLM) with DDP on 2 gloo ranks through the
   torch adapter, and times every microbatch's encoder and LLM forward; between
   the two runs the cost model is calibrated (least squares) to the timings of
   the first, and the plan that ``entrain`` is served from carries that fit;
5. prints the balance table (per-microbatch load CV measured in this run, the
   cost model's CV, measured and simulated step time) and plots the loads.

Everything it starts (service, workers, ranks) is stopped before it returns.

Modules: ``model`` (the tiny MLLM's cost-model view), ``ranks`` (the training ranks),
``report`` (figures, table, plot), ``cli`` (``run_demo`` and the ``demo`` command). Installed as
``entrain_data.demo``: an application on top of the service and the adapters, part of neither.
"""
