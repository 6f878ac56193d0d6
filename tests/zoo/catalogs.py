"""The zoo's catalogs by name: ``main`` (``catalog``, the first zoo), ``wide`` (``catalog_wide``, a second zoo of
other models chosen for variety of ops) and ``third`` (``catalog_third``, a third zoo of models neither has). Each
catalog module defines ``MODELS`` (name -> ``ZooModel``)."""

from __future__ import annotations

import importlib
from types import ModuleType

from .catalog import ZooModel

CATALOGS = {"main": "tests.zoo.catalog", "wide": "tests.zoo.catalog_wide", "third": "tests.zoo.catalog_third"}
DEFAULT_CATALOG = "main"


def check_catalog(catalog: str) -> str:
    """``catalog`` if the zoo has it, else a ValueError naming the known ones."""
    if catalog not in CATALOGS:
        raise ValueError(f"unknown zoo catalog {catalog!r}; known: {', '.join(CATALOGS)}")
    return catalog


def catalog_module(catalog: str = DEFAULT_CATALOG) -> ModuleType:
    return importlib.import_module(CATALOGS[check_catalog(catalog)])


def models(catalog: str = DEFAULT_CATALOG) -> dict[str, ZooModel]:
    """The catalog's models by name, in catalog order."""
    return catalog_module(catalog).MODELS


def get(name: str, catalog: str = DEFAULT_CATALOG) -> ZooModel:
    """The model ``name`` of ``catalog``; an unknown name raises a KeyError naming the catalog's models."""
    found = models(catalog)
    if name not in found:
        raise KeyError(f"unknown model {name!r} in the {catalog} zoo; known: {', '.join(found)}")
    return found[name]
