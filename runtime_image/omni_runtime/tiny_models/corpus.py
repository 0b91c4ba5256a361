"""A small English corpus, embedded so tokenizers can be trained with no network.

The text only has to cover common English words, punctuation and digits well enough that a
byte-level BPE learns about a thousand merges; its content does not matter otherwise.
"""

from __future__ import annotations

__all__ = ["CORPUS", "corpus_lines"]

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small cat sleeps on the warm windowsill in the afternoon sun.
A red apple, a green pear and a yellow banana lie in a wooden bowl on the kitchen table.
The city wakes up slowly: buses hum along the wide streets, shops open their doors, and people hurry to work.
In the mountains the air is cold and clear. Snow covers the high peaks, and rivers run fast through the valleys.
A photograph of a lighthouse at sunset, with orange clouds over a calm blue sea and a boat near the rocks.
A painting of a quiet village in autumn: golden trees, a stone bridge, and smoke rising from a chimney.
An astronaut rides a white horse across the surface of the moon, with the earth glowing in the black sky.
A portrait of an old man with a grey beard, wearing a blue hat, smiling gently at the camera.
A futuristic city at night, neon lights reflected in wet streets, flying cars between tall glass towers.
A bowl of hot soup with fresh bread on the side, steam rising in the soft light of a winter evening.
A forest path covered in fallen leaves, tall pine trees, morning mist, and rays of light between the branches.
A close-up photo of a bee on a purple flower, sharp detail, shallow depth of field, natural colours.
A watercolor sketch of a sailing ship on stormy waves, dark clouds, white foam and a flash of lightning.
Two children fly a kite on a green hill while their dog runs after them, barking with joy.
A cozy library with wooden shelves full of books, a leather chair, a reading lamp and a sleeping cat.
A desert landscape with red dunes, a single cactus, and a bright full moon rising over the horizon.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Please describe the picture in more detail, including the colours, the light, the mood and the style.
You are a helpful assistant. Answer the question clearly, briefly and politely.
The user asked for an image of a garden. The assistant wrote a longer prompt with flowers, a fountain and birds.
Write a short story about a robot who learns to paint. The robot practiced every day, mixing colours and
watching the sky, until one morning it painted a sunrise so beautiful that the whole town came to see it.
Once upon a time there was a little mouse who lived under the stairs of a big house. Every night she
went out to look for cheese, and every morning she told her friends about the strange things she had seen.
Science explains the world with careful observation, measurement and experiment. Water boils at one hundred
degrees Celsius at sea level, and light travels about three hundred thousand kilometres every second.
The numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 20 25 50 64 100 128 256 512 1000 1024 2048 2024 2025 appear here.
Dates and times: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday; January, February,
March, April, May, June, July, August, September, October, November and December; at 9:30 in the morning.
Computers store information as bits and bytes. A program reads input, processes it and writes output.
Servers answer requests from clients over the network; a load balancer spreads the work across replicas.
A model is trained on data, evaluated on a test set, and then deployed to serve predictions for users.
Kubernetes runs containers in pods, schedules them on nodes, and restarts them when they fail.
The pipeline has several stages: a language model writes text, a diffusion model draws the image,
and a decoder turns the latent into pixels. Each stage can scale on its own.
Music fills the room: a piano plays a slow melody, a violin answers, and a drum keeps the rhythm.
The weather today is sunny with a light breeze; tomorrow there will be rain in the north and wind by the coast.
She opened the window, took a deep breath, and decided that this was the day to start something new.
He walked to the station, bought a ticket, and waited on the platform while the train arrived on time.
They built a small house by the lake, planted tomatoes and beans, and watched the birds every evening.
We cook dinner together: chop the onions, fry the garlic, add the tomatoes, and let the sauce simmer.
Cheerful, bright, calm, dark, elegant, gentle, huge, tiny, vivid, ancient, modern, simple, detailed, soft.
High quality, highly detailed, cinematic lighting, dramatic shadows, wide angle, studio photo, 4k, 8k.
Oil painting, pencil drawing, digital art, pixel art, anime style, cartoon, realistic, abstract, minimal.
Questions and answers: Why is the sky blue? Because air scatters blue light more than red light.
What is the capital of France? Paris. How many legs does a spider have? Eight. Who wrote this? Nobody knows.
A friendly dragon guards a castle on a hill, its scales shining like emeralds in the morning light.
A mug of coffee on a desk next to a laptop, a notebook, a pen and a small green plant in a pot.
Waves crash against the cliffs; seagulls circle above the harbour, where fishing boats rest in the water.
Thank you for your help. You're welcome! It's a pleasure. Let's meet again soon; I'll bring the maps.
"""  # noqa: E501 (changing the text changes every trained tokenizer: bump the model VERSIONs)


def corpus_lines(repeat: int = 1) -> list[str]:
    """The corpus as a list of non-empty lines, repeated `repeat` times (trainers count frequencies)."""
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    return lines * repeat
