"""Stand-ins for the helpers of hivemind's ``tests/test_utils`` package, which hivemind's sdist does not ship
(its tests import them). Written here from what the tests need, not copied: see tests/upstream/__init__.py."""
