"""What the tests share besides pytest's fixtures (tests/conftest.py): running verl's command and the pipeline
(`runs`), the rows a run logs (`rows`), a run's processes (`processes`), Ray's call guard and the session
clusters (`clusters`), the oracle of what each step trains (`lineage`), and pieces single tests use
(`scripted_server`, `stage_chain`, `browser`, `key_table_record`). Tests import them as `helpers.<module>`:
pytest puts tests/, the folder of the root conftest.py, on the path."""
