"""``python -m moe_fp8.bench``: every benchmark of the library from one entry point.

One file per benchmark kind (``quant``, ``grouped_gemm``, ``layer``, ``dense``, ``train``), each with a
``collect(...) -> rows``; ``presets`` says what each ``--preset`` runs, ``report`` prints and writes
the results (JSON, markdown, PNG), ``timing`` holds the shared timers.
"""
