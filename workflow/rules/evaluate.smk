rule evaluate:
    input:
        teacher="results/teacher.cmf",
        encoded=encoded_student(),
        **reconstructed_student(),
        final="results/model.cmf",
        windows="results/data/windows.h5",
        ood=text_inputs("evaluate.ood", config["evaluate"]["ood"]),
        code=nvg_sources("evaluate"),
    output:
        report="results/eval.json",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/evaluate.log",
    benchmark:
        "benchmarks/evaluate.tsv"
    params:
        settings=settings("evaluate"),
        k=config["teacher_topk"]["k"],
        reconstructed=reconstructed_args,
        benchmarks=chain_benchmarks(),
    threads: TORCH_THREADS
    resources:
        gpu=1,
        mem_mb=16000,
        runtime=lambda wildcards, attempt: 60 * attempt,
    shell:
        "python -m nvg.evaluate --teacher {input.teacher} --encoded {input.encoded}{params.reconstructed} --final {input.final} "
        "--windows {input.windows} --k {params.k:q} --out {output.report} --settings {params.settings:q} "
        "--benchmarks {params.benchmarks:q} > {log} 2>&1"
