"""`fuse-pointwise` vs inductor's own scheduler: kernel-group agreement on the zoo's tiny models.

    .venv/bin/python bench/inductor_fusion.py

Compiles one block of llama-tiny and gpt2-tiny (forward and backward) through AOTAutograd with
inductor's decompositions on CPU, runs inductor's lowering and fusion scheduler (no kernel is
generated or run) and Flint's grouping on the same FX graphs, and prints, per graph, the number of
kernels each forms, how many of inductor's kernels Flint forms exactly, and pair precision / recall
(flint.validate.inductor_fusion; Flint's grouping with the CPU backend's store-or-recompute thresholds);
then the same for whole training steps (embedding, blocks, head and loss) of the zoo's tiny models
and three Hugging Face ones.
"""

from flint.validate.inductor_fusion import check_models, check_steps, total


def _table(title: str, results) -> None:
    print(title)
    print(f"{'graph':<22} {'fusible ops':>11} {'flint kernels':>13} {'inductor kernels':>16} {'exact':>6} "
          f"{'agreement':>9} {'pair P':>6} {'pair R':>6}")
    for r in results + [total(results)]:
        print(f"{r.graph:<22} {r.nodes:>11} {r.flint_kernels:>13} {r.inductor_kernels:>16} {r.exact:>6} "
              f"{r.kernel_agreement:>9.2f} {r.pair_precision:>6.2f} {r.pair_recall:>6.2f}")


def main() -> None:
    _table("One block (the cases the grouping rules were written against):", check_models())
    print()
    _table("Whole training steps (embedding, blocks, head, loss; zoo and Hugging Face models):", check_steps())


if __name__ == "__main__":
    main()
