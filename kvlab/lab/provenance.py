"""Who and what produced a run: the model's weights digest and the library versions, for reports and sweeps."""

from kvlab.files.identity import fingerprint, package_versions
from kvlab.models.sources import load_model

_DIGESTS: dict[str, tuple[str | None, str | None]] = {}


def model_digest(model_name) -> tuple[str | None, str | None]:
    """(weights_sha256, error) of ``model_name`` as this process loads it; memoised."""
    if not isinstance(model_name, str):
        return None, "no model_name parameter"
    if model_name not in _DIGESTS:
        try:
            model = load_model(model_name)  # catalogue names and paths alike
            _DIGESTS[model_name] = (fingerprint(model, weights=True)["weights_sha256"], None)
            del model
        except Exception as e:  # noqa: BLE001  a point's record still gets written; the error says why
            _DIGESTS[model_name] = (None, f"{type(e).__name__}: {e}")
    return _DIGESTS[model_name]


def versions() -> dict:
    return dict(package_versions("kvlab", "torch", "transformers", "papermill", "distributed"))
