"""``lower-to-chakra``'s ``grad-wait`` option: its values and the help the command-line tools show.

A module of its own so that ``flint --help`` and ``flint emit --help`` need not import the lowering.
Not the plan's ``grad_sync`` (``step`` / ``microbatch``: how often data-parallel gradients are
reduced); this option says where the compute stream waits for a reduction once it is issued.
"""

#: ``part``: the compute stream waits for a gradient reduction a part leaves unwaited at the next part
#: (where the program's wait is); ``optimizer``: at the optimizer (Megatron-LM's ``finish_grad_sync``).
GRAD_WAIT = ("part", "optimizer")
GRAD_WAIT_HELP = ("where the compute stream waits for a data-parallel gradient reduction a part leaves unwaited: "
                  "part (the default: at the next part, where the program waits) or optimizer (at the optimizer, "
                  "as Megatron-LM's finish_grad_sync)")
