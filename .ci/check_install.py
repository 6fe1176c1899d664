"""Checks that the installed tessel (not the source tree) holds every module and data file of the repository."""

import importlib
import pathlib
import sys

FOLDERS = {folder: f"tessel.{folder}" for folder in ("kernels", "layers", "parallel", "bench")}
DATA_SUFFIXES = {".txt", ".json", ".bin", ".gz", ".md"}


def main(repo: pathlib.Path) -> int:
    missing = []
    for folder, package in FOLDERS.items():
        module = importlib.import_module(package)
        installed = pathlib.Path(module.__file__).parent
        if repo.resolve() in installed.resolve().parents:
            print(f"check-install: {package} was imported from the source tree ({installed})", file=sys.stderr)
            return 1
        for source in (repo / folder).rglob("*"):
            if "__pycache__" in source.parts or source.is_dir():
                continue
            wanted = source.suffix == ".py" or (source.parent.name == "data" and source.suffix in DATA_SUFFIXES)
            if wanted and not (installed / source.relative_to(repo / folder)).is_file():
                missing.append(f"{package}: {source.relative_to(repo)}")
    for name in missing:
        print(f"check-install: not installed: {name}", file=sys.stderr)
    if not missing:
        print(f"check-install: every module and data file of {', '.join(FOLDERS.values())} is installed")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
