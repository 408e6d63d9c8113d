"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def library() -> str:
    """Return the path of the mambafuse custom-op library; FAIL (never skip) when it is not built.

    The Makefile builds the library before the tests run, so a missing library is a broken setup.
    """
    import contrib_ops

    try:
        return contrib_ops.library_path()
    except contrib_ops.LibraryNotFoundError as error:
        pytest.fail(str(error), pytrace=False)
