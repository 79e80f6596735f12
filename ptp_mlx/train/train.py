"""Phase 2 (placeholder until written)."""


def add_train_args(p):
    pass


def train_from_args(args):
    raise NotImplementedError
