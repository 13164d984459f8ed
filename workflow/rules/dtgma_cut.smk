# Optional (dtgma.keep set): train MLP neuron gates against the teacher and cut the FFN tensors exactly.
rule dtgma_cut:
    input:
        student="results/student/encoded.cmf",
        windows="results/data/windows.h5",
        topk=topk_shards(),
        code=nvg_sources("dtgma_cut"),
    output:
        cmf="results/student/masked.cmf",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/dtgma_cut.log",
    benchmark:
        "benchmarks/dtgma_cut.tsv"
    params:
        settings=settings("dtgma"),
    threads: TORCH_THREADS
    resources:
        gpu=1,
        mem_mb=16000,
        runtime=lambda wildcards, attempt: 120 * attempt,
    shell:
        "python -m nvg.dtgma_cut --student {input.student} --windows {input.windows} --topk {input.topk} "
        "--out {output.cmf} --settings {params.settings:q} > {log} 2>&1"
