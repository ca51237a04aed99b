"""``lower-to-chakra``'s ``grad-wait`` option: its values and the help the command-line tools show.

A module of its own so that ``flint --help`` and ``flint emit --help`` need not import the lowering.
:func:`add_grad_wait_flag` adds ``--grad-wait`` to a command, and the option's old name, ``--grad-sync``,
as a hidden flag whose use is an error naming the new one.
Not the plan's ``grad_sync`` (``step`` / ``microbatch``: how often data-parallel gradients are
reduced); this option says where the compute stream waits for a reduction once it is issued.
"""

#: ``part``: the compute stream waits for a gradient reduction a part leaves unwaited at the next part
#: (where the program's wait is); ``optimizer``: at the optimizer (Megatron-LM's ``finish_grad_sync``).
GRAD_WAIT = ("part", "optimizer")
GRAD_WAIT_HELP = ("where the compute stream waits for a data-parallel gradient reduction a part leaves unwaited: "
                  "part (the default: at the next part, where the program waits) or optimizer (at the optimizer, "
                  "as Megatron-LM's finish_grad_sync)")


def add_grad_wait_flag(parser, prefix: str = "") -> None:
    """``--grad-wait`` (help: ``prefix`` + the option's help), and ``--grad-sync`` refused with the new name."""
    import argparse

    class _Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error("--grad-sync is now --grad-wait (part or optimizer; 'step' is now 'optimizer'); "
                         "the plan field grad_sync is a different thing: how often gradients are reduced")

    parser.add_argument("--grad-wait", choices=GRAD_WAIT, default=None, help=prefix + GRAD_WAIT_HELP)
    parser.add_argument("--grad-sync", action=_Renamed, help=argparse.SUPPRESS)
