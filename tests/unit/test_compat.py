from __future__ import annotations

import pytest

from areal_plugins._compat import SUPPORTED_VERL, UnsupportedVerlVersionError, check_verl_version


def test_installed_verl_is_supported():
    assert check_verl_version() == "0.9.1"


@pytest.mark.parametrize("version", ["0.9.0", "0.9.2", "0.10.0", "0.4.1"])
def test_other_versions_are_refused_with_both_versions_named(version):
    with pytest.raises(UnsupportedVerlVersionError) as error:
        check_verl_version(version)
    message = str(error.value)
    assert f"verl {version} is installed" in message
    assert str(SUPPORTED_VERL) in message
    assert "pip install" in message
