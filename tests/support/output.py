"""A finished output written in this process by the project's own steps: preparation (tokenize, plan, claim,
job files), the real model's forward through the pipeline, the batch writer, the uploader's record of each
file and finalize's manifest. What a worker and its uploader do, without their processes: for unit tests that
read or damage an output (the CLI's own runs are scenarios)."""

from pathlib import Path

from support.cli import E2E_LAYERS, TINY_LIMITS


def write_output(root: Path, model: Path, data: Path, **options) -> Path:
    """The output of ``hsextract run`` with the shared finished run's options (``support.cli.e2e_run_args``:
    2 shards, ``E2E_LAYERS``, the tiny limits) under ``root`` (``out``, ``run``, ``staging``); returns
    ``root/out``. ``options`` replace RunConfig fields."""
    from hsextract.config import RunConfig
    from hsextract.container import read_file_head
    from hsextract.model.capture import model_final_norm
    from hsextract.model.load import load_model_for, torch_device
    from hsextract.output import batch_metadata, write_batch_file
    from hsextract.output.ledger import RunInfo, stored_record, write_done
    from hsextract.prepare.tokenfile import TokenizedSamples
    from hsextract.run.launcher import finish_output
    from hsextract.run.pipeline import Extractor
    from hsextract.run.preflight import prepare_run
    from hsextract.run.rundir import RunDir
    from hsextract.storage import open_sink

    fields = dict(
        model=str(model),
        data=data if isinstance(data, tuple) else str(data),  # a tuple: several sources
        output=str(root / "out"),
        run_dir=str(root / "run"),
        staging=str(root / "staging"),
        device="cpu",
        dtype="float32",
        layers=",".join(map(str, E2E_LAYERS)),
        shards=2,
        num_proc=1,
        **TINY_LIMITS,
    )
    cfg = RunConfig(**{**fields, **options})
    plan = prepare_run(cfg, echo=lambda *_: None, show_progress=False)
    run_dir = RunDir(cfg.run_dir)
    info = RunInfo.load(run_dir)
    samples = TokenizedSamples.load(run_dir.tokens_file)
    sink = open_sink(cfg.output)
    device = torch_device(cfg)
    lm = load_model_for(cfg, device)
    if info.layout.final_state:
        model_final_norm(lm).write(sink)
    extractor = Extractor(
        lm,
        info.layout.slot_layers,
        device=device,
        max_tokens=max(b.num_tokens for b in plan.batches),
        num_slots=1,
        pad_token_id=info.pad_token_id,
        storage_dtype=info.layout.storage_dtype,
        check_states=cfg.check_states,
        target_topk=info.layout.target_topk,
    )
    staging = cfg.staging_dir
    staging.mkdir(parents=True, exist_ok=True)

    def write_and_upload(batch, tensors):  # the worker's writer, then its uploader
        meta = batch_metadata(
            run_meta=info.file_metadata,
            batch_id=batch.batch_id,
            shard=batch.shard,
            sample_ids=[samples.sample_ids[i] for i in batch.sample_indices],
        )
        path = staging / Path(batch.key).name
        _, crc32 = write_batch_file(path, tensors, meta)
        stored = sink.put_file(path, batch.key, expected_crc32=crc32)
        write_done(sink, stored_record(stored, sink.url, read_file_head(path)), plan.plan_hash)
        path.unlink()

    for shard in range(plan.shards):
        extractor.run(plan.for_shard(shard), samples, write_and_upload)
    code, todo = finish_output(sink, echo=lambda *_: None)
    assert code == 0 and not todo, (code, todo)
    return root / "out"
