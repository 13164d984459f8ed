rule export:
    input:
        trained="results/train/trained.cmf",
        code=nvg_sources("export"),
    output:
        cmf="results/model.cmf",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/export.log",
    params:
        # the settings of every stage that shaped the model, recorded as provenance
        pipeline=json.dumps({**{k: v for k, v in config.items() if k != "evaluate"}, "encode": encode_block(),
                             "train": train_block(), "generate_corpus": corpus_block()},
                            sort_keys=True),
    resources:
        mem_mb=4000,
        runtime=10,
    shell:
        "python -m nvg.export --trained {input.trained} --out {output.cmf} --settings {params.pipeline:q} > {log} 2>&1"
