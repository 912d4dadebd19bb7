"""Stands in for spacy where it is not installed (a GPU machine without a network): OpenNMT-py 3.5.1 imports every
transform module when it starts, and only its `terminology` transform uses spacy; bench_peers uses no transform.
Put on PYTHONPATH by benchmarks/gpu_session.sh's peers stage only where `import spacy` fails."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"spacy.{name}: spacy is not installed here (benchmarks/peers/offline stands in for it so that "
                      f"OpenNMT-py starts)")
