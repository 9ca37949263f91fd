"""The one error type users see: a single line naming the file, row/field and what was expected."""


class NlaInputError(Exception):
    """Bad user input (config, parquet, sidecar, tokenizer). The CLI prints it as one line, exit 2."""

    def __init__(self, where: str, problem: str):
        self.where = str(where)
        self.problem = problem
        super().__init__(f"{self.where}: {problem}")
