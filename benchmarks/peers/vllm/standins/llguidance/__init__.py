"""A stand-in for llguidance in the peers' vLLM site, installed by ``pieces.sh stash`` only when the fetch left
llguidance out (no llguidance >= 1.7 wheel on the index; ``VLLM_WITHOUT=llguidance``).

vLLM 0.26 imports its ``guidance`` structured-output backend when its OpenAI server module loads, and that backend
names ``llguidance`` types in a class body: without the module the server does not import at all. The benchmarks send
no structured-output request, and vLLM's default backend is xgrammar; any use of a stand-in type raises ImportError,
so a run that needed llguidance fails loudly instead of measuring something else.
"""


class Missing:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise ImportError("llguidance is a stand-in here (benchmarks/peers/vllm/standins): no wheel was fetched")


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing
