"""Quality measured: unlimisum's summaries of a data set scored against references, beside baselines.

``data`` reads the JSON Lines; ``baselines`` writes what the same model writes without reading the whole book;
``metrics`` scores a summary (ROUGE, EntMent, BERTScore); ``statistics`` gives means with bootstrap intervals
and paired differences; ``run`` goes through the data, keeping each result as it is scored; ``outputs`` makes the
Markdown report and the plot. `unlimisum evaluate` (unlimisum/cli/evaluate.py) is the command.
"""
