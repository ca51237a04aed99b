"""``lower-to-chakra``'s ``grad-sync`` option: its values and the help the command-line tools show.

A module of its own so that ``flint --help`` and ``flint emit --help`` need not import the lowering.
"""

#: ``part``: the compute stream waits for a gradient reduction a part leaves unwaited at the next part
#: (where the program's wait is); ``step``: at the optimizer (Megatron-LM's ``finish_grad_sync``).
GRAD_SYNC = ("part", "step")
GRAD_SYNC_HELP = ("where the compute stream waits for a data-parallel gradient reduction a part leaves unwaited: "
                  "part (the default: at the next part, where the program waits) or step (at the optimizer, as "
                  "Megatron-LM's finish_grad_sync)")
