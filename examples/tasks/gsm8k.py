"""GSM8K as a genrun task (data.train_tasks, docs/configuration.md): the number after '####' in
the `answer` column becomes `reward_model.ground_truth`, as verl's gsm8k preprocessing script
writes it, so verl's gsm8k scorer (data_source openai/gsm8k) can score the trajectories."""

from generation_core.inputs.tasks import Task


class GSM8KTask(Task):
    def build_row(self, row, index):
        built = super().build_row(row, index)
        built["reward_model"] = {
            "style": "rule",
            "ground_truth": row["answer"].split("####")[-1].strip().replace(",", ""),
        }
        built["ability"] = "math"
        return built
