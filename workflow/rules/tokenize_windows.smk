# Calibration windows from every data source; the source `generated` brings in the generate_corpus shards.
rule tokenize_windows:
    input:
        teacher="results/teacher.cmf",
        generated=generated_corpus(),
        texts=text_inputs("data.sources", [src["path"] for src in config["data"]["sources"]]),
        code=nvg_sources("tokenize_windows"),
    output:
        windows="results/data/windows.h5",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/tokenize_windows.log",
    benchmark:
        "benchmarks/tokenize_windows.tsv"
    params:
        settings=settings("data"),
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "python -m nvg.tokenize_windows --teacher {input.teacher} --out {output.windows} "
        "--generated {input.generated} --settings {params.settings:q} > {log} 2>&1"
