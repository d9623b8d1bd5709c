"""What the tests share that is not a pytest fixture. The tests import it as `helpers.<module>`: tests/ is on
the path (pytest puts the folder of tests/conftest.py there)."""
