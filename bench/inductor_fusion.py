"""`fuse-pointwise` vs inductor's own scheduler: kernel-group agreement on the zoo's tiny models.

    .venv/bin/python bench/inductor_fusion.py

Compiles one block of llama-tiny and gpt2-tiny (forward and backward) through AOTAutograd with
inductor's decompositions on CPU, runs inductor's lowering and fusion scheduler (no kernel is
generated or run) and Flint's grouping on the same FX graphs, and prints, per graph, the number of
kernels each forms, how many of inductor's kernels Flint forms exactly, and pair precision / recall
(flint.validate.inductor_fusion).
"""

from flint.validate.inductor_fusion import check_models, total


def main() -> None:
    results = check_models()
    print(f"{'graph':<18} {'fusible ops':>11} {'flint kernels':>13} {'inductor kernels':>16} {'exact':>6} "
          f"{'agreement':>9} {'pair P':>6} {'pair R':>6}")
    for r in results + [total(results)]:
        print(f"{r.graph:<18} {r.nodes:>11} {r.flint_kernels:>13} {r.inductor_kernels:>16} {r.exact:>6} "
              f"{r.kernel_agreement:>9.2f} {r.pair_precision:>6.2f} {r.pair_recall:>6.2f}")


if __name__ == "__main__":
    main()
