"""A reward function whose module takes 2 s to import, as a heavy verifier's may on a busy machine."""

import time

time.sleep(2.0)


def score(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str == ground_truth)
