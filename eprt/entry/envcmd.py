"""``eprt env``: print the environment-variable registry."""

from eprt import env


def add_arguments(parser):
    pass


def main(args) -> int:
    print(env.describe())
    return 0
