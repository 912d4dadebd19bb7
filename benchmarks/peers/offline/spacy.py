"""Stands in for spacy where it is not installed (a GPU machine without a network): OpenNMT-py 3.5.1 imports every
transform module when it starts, and only its `terminology` transform uses spacy; bench_peers uses no transform.
Put on PYTHONPATH by benchmarks/gpu_session.sh's peers stage only where `import spacy` fails."""
from _absent import absent

__getattr__ = absent("spacy")
