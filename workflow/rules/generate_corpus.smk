# One job per shard, like the teacher pass: the teacher writes its own calibration text as token ids.
rule generate_corpus:
    input:
        teacher="results/teacher.cmf",
        prompts=text_inputs("generate_corpus.prompts", [config["generate_corpus"]["prompts"]]),
        code=nvg_sources("generate_corpus"),
    output:
        corpus="results/corpus/generated.{shard}.h5",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/generate_corpus.{shard}.log",
    benchmark:
        "benchmarks/generate_corpus.{shard}.tsv"
    params:
        settings=json.dumps(corpus_block(), sort_keys=True),
    threads: TORCH_THREADS
    resources:
        gpu=1,
        mem_mb=16000,
        runtime=lambda wildcards, attempt: 60 * attempt,
    shell:
        "python -m nvg.generate_corpus --teacher {input.teacher} --shard {wildcards.shard} --out {output.corpus} "
        "--settings {params.settings:q} > {log} 2>&1"
