"""What the stand-ins beside it share: a module attribute that says the real package is not installed here."""


def absent(package: str):
    """A module-level __getattr__ for a stand-in of `package`: dunder lookups fail as for any module, and every
    other name raises ImportError naming the package."""
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"{package}.{name}: {package} is not installed here (benchmarks/peers/offline stands in "
                          f"for it so that OpenNMT-py starts)")
    return __getattr__
