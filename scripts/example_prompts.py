"""The prompts the example models are judged on (standard library only: the benchmark's peers load it too).

`README_PROMPTS` are the prompts the README shows for each example model; `LONG_PROMPTS` are longer than Gemma 3's
512-token sliding window (about 700 and 1,400 tokens with its tokenizer), so a decode that runs over them reads
sliding-window layers whose window has already moved past the prompt's start. The text is this project's own.
"""

README_PROMPTS: dict[str, tuple[str, ...]] = {
    "smollm2-135m-instruct": ("What is the capital of France?",),
    "gemma3-270m": ("The capital of France is",),
}

_PARAGRAPHS = (
    "Before the telegraph, a weather observation could travel no faster than a rider or a ship, so a storm usually"
    " arrived before any news of it. Once wires linked distant towns, observers could send readings of pressure,"
    " wind and temperature to a central office within an hour. Clerks plotted the numbers on a map, drew lines"
    " through places of equal pressure, and for the first time saw the shape of a storm as a whole rather than as"
    " a local event. The earliest forecasts made from such maps were rough, and newspapers often mocked them when"
    " they failed, but harbour masters found that even an imperfect warning of a gale saved boats and lives. Over"
    " the following decades the networks grew denser, the instruments more reliable, and the offices learned which"
    " patterns on the map tended to repeat from one season to the next.",
    "A second change came from the upper air. Balloons carrying small instruments rose through the clouds and radioed"
    " back how temperature and humidity changed with height. Pilots reported strong winds far above the ground that"
    " nobody had measured before, and these fast currents turned out to steer the storms below them. Forecasters"
    " began to think of the atmosphere as a fluid with layers, each pushing on the others, instead of as a thin"
    " sheet of weather resting on the surface. This view explained why a forecast based only on surface maps so"
    " often went wrong after a day or two: the surface showed where a storm was, but the air aloft decided where it"
    " would go next.",
    "The idea of computing the weather from the laws of physics is older than the machines that made it practical."
    " An early attempt by hand took weeks of arithmetic to predict six hours ahead, and the answer was badly wrong"
    " because the starting data contained small errors that the equations magnified. When electronic computers"
    " appeared, one of their first serious tasks was a simplified forecast of the flow over a continent. It ran"
    " slowly and used a coarse grid, yet it showed that the method worked when the equations were chosen with care."
    " Each new generation of computers allowed a finer grid, more layers in the vertical, and more of the physical"
    " processes, such as rain and sunlight, to be represented directly.",
    "Satellites filled the largest remaining gap. Most of the planet is ocean, desert or ice, where nobody lives to"
    " read a barometer, and storms that formed there were once discovered only when they reached a coast. Images"
    " from orbit showed cloud patterns over the whole globe every few minutes, and later instruments measured"
    " temperature and moisture through the depth of the atmosphere from space. Feeding these measurements into the"
    " computer models turned out to be a hard problem of its own, because each instrument sees the air in a"
    " different way and with different errors, and the model must combine them into one consistent picture of the"
    " present before it can say anything about the future.",
    "Modern centres no longer run a single forecast. They run the same model many times, each run starting from a"
    " slightly different picture of the present, and look at how far the results spread apart. When the runs agree,"
    " the forecast can be trusted for many days; when they scatter, the honest answer is a range of possibilities"
    " with their chances. This is why forecasts now speak of a seventy percent chance of rain rather than promising"
    " rain or sunshine. The spread itself has become a product: farmers, power companies and airlines use it to"
    " decide how much risk to accept, and emergency services use it to prepare for the worst case while hoping for"
    " the most likely one.",
    "Local effects still defeat the best global models. A valley can trap cold air on a clear night while the hills"
    " around it stay mild, a lake can feed a narrow band of heavy snow downwind of its shore, and a city's streets"
    " and roofs can keep it several degrees warmer than the fields outside. Forecasters handle these cases with"
    " smaller models nested inside the large ones, with statistics learned from years of past forecasts and what"
    " actually happened, and with the experience of people who have watched the same hills and shores for a long"
    " time. A good local forecast is therefore a blend of physics, records and judgement rather than the raw output"
    " of any one program.",
    "Communicating a forecast is a skill separate from making it. A warning that is too technical is ignored, and one"
    " that cries wolf too often loses its audience for the day when the danger is real. Weather services have tried"
    " colour codes, plain-language headlines, maps of expected impacts rather than of rainfall totals, and messages"
    " sent straight to phones in the affected area. Studies after major storms often find that people who received"
    " a warning did not act on it because they did not believe it applied to them, which has pushed services to"
    " describe what a storm will do to roads, rivers and power lines instead of only how strong it will be.",
    "Climate and weather are often confused, but they answer different questions. A weather forecast tries to say"
    " what the atmosphere will do on a particular day in a particular place, and its skill fades after one or two"
    " weeks because small uncertainties grow. A climate projection asks how the statistics of weather, such as the"
    " average temperature of a season or how often a heavy downpour occurs, will shift over decades. The same kind"
    " of model can serve both purposes, yet the way its results are read is different: nobody expects a climate"
    " run to say whether it will rain on a given afternoon fifty years from now.",
    "Machine learning has recently entered the field from an unexpected direction. Models trained on decades of"
    " past analyses can now produce global forecasts in minutes on a single accelerator, and on many measures they"
    " match the traditional physics models that need a supercomputer for an hour. They have weaknesses of their"
    " own: they may smooth away the extremes that matter most, and they learn only from the climate of the past."
    " Most centres are therefore testing them beside the physics models rather than in place of them, and some use"
    " the two together, letting each correct the blind spots of the other.",
    "Through all of these changes, observation has remained the foundation. A forecast is only as good as its"
    " picture of the present, and that picture still depends on thermometers in fields, buoys drifting at sea,"
    " aircraft reporting as they climb, and volunteers who measure rainfall in their gardens every morning. When a"
    " network of stations is closed to save money, the loss shows up years later as forecasts that are slightly"
    " worse in that region, a cost that is easy to overlook because nobody can point to the storm that a missing"
    " station failed to catch.",
)

LONG_PROMPTS: tuple[str, ...] = (
    "\n\n".join(_PARAGRAPHS[:5]) + "\n\nIn one sentence, the main reason early computed forecasts failed was",
    "\n\n".join(_PARAGRAPHS) + "\n\nSummary of the text above, in three short points:\n1.",
)
