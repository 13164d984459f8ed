# One HTML page a person would rather look at than read: results/report.html.
rule report:
    input:
        evaluation="results/eval.json",
        encode="results/student/encode.json",
        metrics="results/train/metrics.jsonl",
        code=nvg_sources("report"),
        template=os.path.relpath(NVG / "templates" / "report.html.j2"),
    output:
        html="results/report.html",
        png="results/report.png",
    conda:
        "../envs/nvg.yaml"
    log:
        "logs/report.log",
    params:
        teacher=config["teacher"],
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python -m nvg.report --eval {input.evaluation} --encode {input.encode} --metrics {input.metrics} "
        "--out {output.html} --png {output.png} --teacher-name {params.teacher:q} > {log} 2>&1"
